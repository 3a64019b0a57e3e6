"""Families whose difficulty is the exact output format: RESULT frame, JSON, case, repetition.

The seeds' lesson is that models fail these on form rather than substance
("RESULT:43", a fenced JSON block, "Tiger"), so each family's dominant
violation is its typical format slip.
"""

from __future__ import annotations

import json
import random

from rlhflab.tasks.base import Draw, Family, TaskItem, blank, misspell, phrase
from rlhflab.tasks.pools import ContentPool, carry_free_pairs
from rlhflab.tasks.rules import standard_rules

# --- sum_result ---------------------------------------------------------------------

SUM_TEMPLATES = (
    "Add {a} and {b}. Answer as RESULT: <sum>\n",
    "What is {a} plus {b}? Reply in the form RESULT: <sum>\n",
    "Compute {a} + {b}. Give the answer as RESULT: <sum>\n",
)
SUM_CHATTER = ("The sum is {s}. RESULT: {s}", "Sure! RESULT: {s}", "RESULT: {s} is the answer.")


def _make_sum(rng: random.Random, pool: ContentPool) -> Draw:
    a, b = rng.choice(carry_free_pairs(tuple(n for n in pool.numbers if 10 <= n <= 99)))  # aligned digits
    return Draw({"a": str(a), "b": str(b)}, f"RESULT: {a + b}", (str(a), str(b)))


def _sum(item: TaskItem) -> int:
    return int(item.reference.removeprefix("RESULT: "))


SUM_RESULT = Family(
    name="sum_result",
    templates=SUM_TEMPLATES,
    frames=("RESULT: ", "RESULT:", *map(blank, SUM_CHATTER)),
    kinds=("missing_space", "wrong_content", "wrong_case", "extra_space", "extra_chatter", "missing_eos"),
    maker=_make_sum,
    violators={
        "missing_space": lambda item, rng: f"RESULT:{_sum(item)}",
        "wrong_content": lambda item, rng: f"RESULT: {_sum(item) + rng.choice((1, -1, 10, -10))}",
        "wrong_case": lambda item, rng: phrase(rng, ("result: {s}", "Result: {s}"), s=_sum(item)),
        "extra_space": lambda item, rng: phrase(rng, ("RESULT:  {s}", "RESULT: {s} ", " RESULT: {s}"), s=_sum(item)),
        "extra_chatter": lambda item, rng: phrase(rng, SUM_CHATTER, s=_sum(item)),
    },
    rules=standard_rules(),
)

# --- json_object --------------------------------------------------------------------

JSON_KEYS = ("name", "word", "item")
JSON_TEMPLATES = (
    'Return bare JSON with key "{key}" set to "{value}".\n',
    'Output a JSON object mapping "{key}" to "{value}", with no code fence.\n',
    'Give only JSON: key "{key}", value "{value}".\n',
)
JSON_CHATTER = ("Here is the JSON: {j}", "Sure! {j}", "{j} is the JSON.")


def _make_json(rng: random.Random, pool: ContentPool) -> Draw:
    key, value = rng.choice(JSON_KEYS), rng.choice(pool.words)
    return Draw({"key": key, "value": value}, json.dumps({key: value}), (value,))


def _pair(item: TaskItem) -> tuple[str, str]:
    ((key, value),) = json.loads(item.reference).items()
    return key, value


def _json_case(item: TaskItem, rng: random.Random) -> str:
    key, value = _pair(item)
    return json.dumps({key.upper(): value}) if rng.random() < 0.5 else json.dumps({key: value.capitalize()})


JSON_OBJECT = Family(
    name="json_object",
    templates=JSON_TEMPLATES,
    frames=('{"', '": "', '"}', "```json\n", "\n```", *map(blank, JSON_CHATTER)),
    kinds=("fenced_json", "missing_space", "extra_space", "wrong_case", "wrong_content", "extra_chatter", "missing_eos"),
    maker=_make_json,
    violators={
        "fenced_json": lambda item, rng: phrase(rng, ("```json\n{j}\n```", "```\n{j}\n```"), j=item.reference),
        "missing_space": lambda item, rng: json.dumps(dict([_pair(item)]), separators=(",", ":")),
        "extra_space": lambda item, rng: "{ " + item.reference[1:-1] + " }",
        "wrong_case": _json_case,
        "wrong_content": lambda item, rng: json.dumps({_pair(item)[0]: misspell(_pair(item)[1])}),
        "extra_chatter": lambda item, rng: phrase(rng, JSON_CHATTER, j=item.reference),
    },
    rules=standard_rules(),
)

# --- lowercase / uppercase ----------------------------------------------------------


def _case_family(name: str, lower: bool) -> Family:
    """Rewrite one word in the asked-for case; the prompt shows it in the other case."""
    case_word = "lowercase" if lower else "uppercase"
    templates = (
        f"Write this word in {case_word}: {{shown}}\n",
        f"Convert to {case_word}: {{shown}}\n",
        f"Rewrite {{shown}} in {case_word} letters.\n",
    )
    chatter = (f"The word in {case_word} is {{w}}.", "Sure! {w}", "Here it is: {w}")

    def make(rng: random.Random, pool: ContentPool) -> Draw:
        word = rng.choice(pool.words)
        shown, answer = (word.upper(), word) if lower else (word, word.upper())
        return Draw({"shown": shown}, answer, (word,))

    def wrong_case(item: TaskItem, rng: random.Random) -> str:
        other = item.reference.upper() if lower else item.reference.lower()
        return rng.choice((other, item.reference.capitalize()))

    return Family(
        name=name,
        templates=templates,
        frames=tuple(map(blank, chatter)),
        kinds=("wrong_case", "wrong_content", "extra_chatter", "extra_space", "missing_eos"),
        maker=make,
        violators={
            "wrong_case": wrong_case,
            "wrong_content": lambda item, rng: misspell(item.reference),
            "extra_chatter": lambda item, rng: phrase(rng, chatter, w=item.reference),
            "extra_space": lambda item, rng: phrase(rng, (" {w}", "{w} "), w=item.reference),
        },
        rules=standard_rules(),
    )


LOWERCASE = _case_family("lowercase", lower=True)
UPPERCASE = _case_family("uppercase", lower=False)

# --- repeat_word --------------------------------------------------------------------

REPEAT_TEMPLATES = (
    "Repeat the word {word} {count} times, separated by spaces.\n",
    "Write {word} exactly {count} times with a space between.\n",
    "Say {word} {count} times, separated by single spaces.\n",
)
REPEAT_CHATTER = ("Sure! {a}", "Here you go: {a}")


def _make_repeat(rng: random.Random, pool: ContentPool) -> Draw:
    word, count = rng.choice(pool.words), rng.randint(2, 4)  # the count is structure, not content
    return Draw({"word": word, "count": str(count)}, " ".join([word] * count), (word,))


def _word_count(item: TaskItem) -> tuple[str, int]:
    return item.content[0], item.reference.count(" ") + 1


def _repeat_case(item: TaskItem, rng: random.Random) -> str:
    word, count = _word_count(item)
    return " ".join([rng.choice((word.capitalize(), word.upper()))] * count)


REPEAT_WORD = Family(
    name="repeat_word",
    templates=REPEAT_TEMPLATES,
    frames=tuple(map(blank, REPEAT_CHATTER)),
    kinds=("wrong_count", "missing_space", "extra_space", "wrong_case", "wrong_content", "extra_chatter", "missing_eos"),
    maker=_make_repeat,
    violators={
        "wrong_count": lambda item, rng: " ".join(
            [_word_count(item)[0]] * (_word_count(item)[1] + rng.choice((-1, 1)))
        ),
        "missing_space": lambda item, rng: item.reference.replace(" ", ""),
        "extra_space": lambda item, rng: item.reference.replace(" ", "  "),
        "wrong_case": _repeat_case,
        "wrong_content": lambda item, rng: " ".join([misspell(_word_count(item)[0])] * _word_count(item)[1]),
        "extra_chatter": lambda item, rng: phrase(rng, REPEAT_CHATTER, a=item.reference),
    },
    rules=standard_rules(sep=" "),
)
