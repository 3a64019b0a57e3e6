"""Near-miss answers: one letter of a copied word changed, always a content failure."""

import random

from rlhflab.tasks import FAMILIES, check, near_misses, sample_items
from rlhflab.tasks.near_miss import VOWELS, near_miss

WORD_FAMILIES = {"comma_list", "keep_order", "first_item", "last_item", "json_object", "lowercase", "uppercase",
                 "repeat_word"}


def letter_changes(a: str, b: str) -> list[tuple[str, str]]:
    assert len(a) == len(b)
    return [(x, y) for x, y in zip(a, b) if x != y]


def test_every_near_miss_is_one_letter_of_one_word_off_and_fails_as_wrong_content():
    rng = random.Random(0)
    for item in sample_items("train", 400, seed=1):
        answer = near_miss(item, rng)
        if item.family not in WORD_FAMILIES:
            assert answer is None, (item.family, answer)  # numbers and yes/no copy no word
            continue
        verdict = check(item, answer)
        assert not verdict.passed and verdict.kind == "wrong_content", (item.reference, answer, verdict)
        changes = letter_changes(item.reference, answer)
        assert len({(x.lower(), y.lower()) for x, y in changes}) == 1  # one letter, wherever the word repeats
        (was, now), *_ = changes
        assert (was.lower() in VOWELS) == (now.lower() in VOWELS) and was.isupper() == now.isupper()
        if item.family == "repeat_word":  # the word is misspelt the same way in every copy
            assert len(set(answer.split(" "))) == 1


def test_near_misses_are_distinct_and_reproducible():
    item = next(i for i in sample_items("train", 50, seed=2) if i.family == "comma_list")
    first = near_misses(item, 3, random.Random(7))
    assert len(first) == 3 and len(set(first)) == 3 and item.reference not in first
    assert near_misses(item, 3, random.Random(7)) == first
    number = next(i for i in sample_items("train", 50, seed=2) if i.family == "sum_result")
    assert near_misses(number, 3, random.Random(7)) == []
    assert set(WORD_FAMILIES) < set(FAMILIES)
