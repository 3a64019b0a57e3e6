"""Families about a short list of words: layout, order, and picking one item.

Items in one prompt are distinct, so "the same items in another order" and
"an item left out" are unambiguous for the checker.
"""

from __future__ import annotations

import random

from rlhflab.tasks.base import Draw, Family, TaskItem, blank, misspell, phrase, rotate
from rlhflab.tasks.pools import ContentPool
from rlhflab.tasks.rules import standard_rules


def _pick(rng: random.Random, pool: ContentPool, low: int, high: int) -> list[str]:
    """Distinct words; the list length is structure, not content."""
    return rng.sample(pool.words, rng.randint(low, high))


def _replace_one(items: tuple[str, ...], rng: random.Random) -> list[str]:
    out = list(items)
    i = rng.randrange(len(out))
    out[i] = misspell(out[i])
    return out


def _list_family(name: str, sep: str, templates: tuple[str, ...], chatter: tuple[str, ...], dominant: str) -> Family:
    """A family whose answer is all the prompt's items, in order, joined by `sep`."""

    def make(rng: random.Random, pool: ContentPool) -> Draw:
        items = _pick(rng, pool, 2, 3)
        return Draw({"items": " ".join(items)}, sep.join(items), tuple(items))

    def wrong_case(item: TaskItem, rng: random.Random) -> str:
        style = rng.choice((str.capitalize, str.upper))
        return sep.join(style(w) for w in item.content)

    violators = {
        "numbered_list": lambda item, rng: "\n".join(f"{i}. {w}" for i, w in enumerate(item.content, 1)),
        "reordered_items": lambda item, rng: sep.join(rotate(item.content)),
        "wrong_case": wrong_case,
        "wrong_content": lambda item, rng: sep.join(_replace_one(item.content, rng)),
        "wrong_count": lambda item, rng: sep.join(item.content[:-1]),
        "extra_chatter": lambda item, rng: phrase(rng, chatter, a=item.reference),
    }
    if sep == ",":  # the typical slip: a space after each comma
        violators["extra_space"] = lambda item, rng: ", ".join(item.content)
    else:  # one per line: trailing spaces on each line
        violators["extra_space"] = lambda item, rng: sep.join(w + " " for w in item.content)
    rest = tuple(k for k in violators if k != dominant)
    return Family(
        name=name,
        templates=templates,
        frames=(sep, ". ", *map(blank, chatter)),
        kinds=(dominant, *rest, "missing_eos"),
        maker=make,
        violators=violators,
        rules=standard_rules(sep=sep),
    )


COMMA_LIST = _list_family(
    "comma_list",
    sep=",",
    templates=(
        "List these items separated by commas with no spaces: {items}\n",
        "Join these words with commas and no spaces: {items}\n",
        "Write these words as a list separated only by commas: {items}\n",
    ),
    chatter=("Here is the list: {a}", "Sure! {a}", "{a} is the list."),
    dominant="extra_space",
)

KEEP_ORDER = _list_family(
    "keep_order",
    sep="\n",
    templates=(
        "Write these items in the given order, one per line: {items}\n",
        "Put each word on its own line, keeping the order: {items}\n",
        "List one item per line in this order: {items}\n",
    ),
    chatter=("Here are the items:\n{a}", "Sure!\n{a}"),
    dominant="numbered_list",
)


def _position_family(name: str, position: str, index: int) -> Family:
    """Reply with one item of a comma-separated list; the typical slip is the wrong item."""
    templates = (
        f"Reply with only the {position} item: {{items}}\n",
        f"Name the {position} item of this list, nothing else: {{items}}\n",
        f"What is the {position} word here? Answer with that word only: {{items}}\n",
    )
    chatter = (f"The {position} item is {{w}}.", "Sure! {w}", "{w} is the answer.")

    def make(rng: random.Random, pool: ContentPool) -> Draw:
        items = _pick(rng, pool, 3, 4)
        return Draw({"items": ", ".join(items)}, items[index], tuple(items))

    def wrong_item(item: TaskItem, rng: random.Random) -> str:
        return rng.choice([w for w in item.content if w != item.reference])

    def wrong_count(item: TaskItem, rng: random.Random) -> str:
        pair = item.content[:2] if index == 0 else item.content[-2:]
        return ", ".join(rng.choice((item.content, pair)))

    return Family(
        name=name,
        templates=templates,
        frames=tuple(map(blank, chatter)),
        kinds=("wrong_content", "wrong_case", "extra_chatter", "extra_space", "wrong_count", "missing_eos"),
        maker=make,
        violators={
            "wrong_content": wrong_item,
            "wrong_case": lambda item, rng: rng.choice((item.reference.capitalize(), item.reference.upper())),
            "extra_chatter": lambda item, rng: phrase(rng, chatter, w=item.reference),
            "extra_space": lambda item, rng: phrase(rng, (" {w}", "{w} "), w=item.reference),
            "wrong_count": wrong_count,
        },
        rules=standard_rules(sep=","),
    )


FIRST_ITEM = _position_family("first_item", "first", 0)
LAST_ITEM = _position_family("last_item", "last", -1)
