"""The checker is exact, and names every generated violation as the kind it was made as."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhflab.errors import UserInputError
from rlhflab.tasks import FAMILIES, SPLITS, VIOLATION_KINDS, TaskItem, check, partition_pools, violations
from rlhflab.tasks.pools import carry_free

SEEDS = st.integers(min_value=0, max_value=2**32 - 1)
FAMILY_NAMES = st.sampled_from(sorted(FAMILIES))


def _item(family: str, split: str, seed: int) -> TaskItem:
    pool = partition_pools(seed % 7)[split]
    return FAMILIES[family].make(random.Random(seed), pool)


def test_suite_shape():
    assert len(FAMILIES) == 11
    used = {k for f in FAMILIES.values() for k in f.kinds}
    assert used == set(VIOLATION_KINDS)  # every declared kind is produced by some family
    for name, family in FAMILIES.items():
        assert family.name == name
        assert family.kinds[0] != "missing_eos"
        assert "missing_eos" in family.kinds
        assert len(family.templates) == 3
        assert len(set(family.kinds)) == len(family.kinds)


@settings(max_examples=60, deadline=None)
@given(family=FAMILY_NAMES, split=st.sampled_from(SPLITS), seed=SEEDS)
def test_reference_passes(family, split, seed):
    item = _item(family, split, seed)
    assert item.prompt.endswith("\n")
    assert check(item, item.reference) == check(item, item.reference, ended_with_eos=True)
    assert check(item, item.reference).passed
    assert check(item, item.reference).kind == "pass"
    assert not check(item, item.reference + " ").passed  # trailing whitespace is not forgiven


@settings(max_examples=80, deadline=None)
@given(family=FAMILY_NAMES, split=st.sampled_from(SPLITS), seed=SEEDS)
def test_every_violation_is_diagnosed_as_its_kind(family, split, seed):
    item = _item(family, split, seed)
    made = violations(item, random.Random(seed + 1))
    assert list(made) == list(FAMILIES[family].kinds)
    for kind, answer in made.items():
        verdict = check(item, answer)
        assert not verdict.passed
        assert (verdict.kind, answer) == (kind, answer)
        assert verdict.reason
    truncated = check(item, item.reference, ended_with_eos=False)
    assert (truncated.passed, truncated.kind) == (False, "missing_eos")


@settings(max_examples=40, deadline=None)
@given(split=st.sampled_from(SPLITS), seed=SEEDS)
def test_sums_are_carry_free_and_counts_match_their_words(split, seed):
    total = _item("sum_result", split, seed)
    a, b = map(int, total.content)
    assert carry_free(a, b) and a != b
    assert total.reference == f"RESULT: {a + b}"
    count = _item("number_only", split, seed)
    assert count.reference == str(len(count.content)) and 2 <= len(count.content) <= 6


def test_carry_free():
    assert carry_free(12, 31) and carry_free(40, 5)
    assert not carry_free(15, 15) and not carry_free(91, 10)


SUM = TaskItem("sum_result", "Add 12 and 31. Answer as RESULT: <sum>\n", "RESULT: 43", ("12", "31"))
JSON = TaskItem("json_object", 'Return bare JSON with key "name" set to "tiger".\n', '{"name": "tiger"}', ("tiger",))
COMMA = TaskItem("comma_list", "List these items ...: red fox cup\n", "red,fox,cup", ("red", "fox", "cup"))
COMMA2 = TaskItem("comma_list", "List these items ...: red fox\n", "red,fox", ("red", "fox"))
LINES = TaskItem("keep_order", "Write these items ...: red fox cup\n", "red\nfox\ncup", ("red", "fox", "cup"))
REPEAT = TaskItem("repeat_word", "Repeat the word tiger 3 times ...\n", "tiger tiger tiger", ("tiger",))
YES = TaskItem("yes_no", "Is 31 greater than 24? Answer yes or no.\n", "yes", ("31", "24"))
NEXT = TaskItem("number_only", "How many words are in this list: red fox? ...\n", "2", ("red", "fox"))
FIRST = TaskItem("first_item", "Reply with only the first item: red, fox, cup\n", "red", ("red", "fox", "cup"))
LOWER = TaskItem("lowercase", "Write this word in lowercase: TIGER\n", "tiger", ("tiger",))


@pytest.mark.parametrize(
    ("item", "answer", "kind", "reason"),
    [
        (SUM, "RESULT:43", "missing_space", "missing space after 'RESULT:'"),
        (SUM, "RESULT: 44", "wrong_content", "does not match the reference 'RESULT: 43'"),
        (SUM, "result: 43", "wrong_case", "wrong letter case: expected 'RESULT: 43'"),
        (SUM, "RESULT: 43 ", "extra_space", "extra whitespace at the start or end"),
        (SUM, "RESULT:  43", "extra_space", "extra space"),
        (SUM, "The sum is 43. RESULT: 43", "extra_chatter", "correct answer wrapped in extra words"),
        (SUM, "RESULT: 43\nRESULT: 43\nRESU", "missing_eos", "run-on answer: repeats itself instead of ending"),
        (JSON, '```json\n{"name": "tiger"}\n```', "fenced_json", "wrapped in a Markdown code fence"),
        (JSON, '{"name":"tiger"}', "missing_space", "missing space"),
        (JSON, '{"name": "Tiger"}', "wrong_case", "wrong letter case: expected '{\"name\": \"tiger\"}'"),
        (COMMA, "1. red\n2. fox\n3. cup", "numbered_list", "numbered list instead of the asked-for layout"),
        (COMMA, "red, fox, cup", "extra_space", "extra space"),
        (COMMA, "cup,red,fox", "reordered_items", "items not in the given order"),
        (COMMA, "red,fox", "wrong_count", "2 items instead of 3"),
        (COMMA, "red,fox,cap", "wrong_content", "does not match the reference 'red,fox,cup'"),
        (COMMA2, "Red,Fox", "wrong_case", "wrong letter case: expected 'red,fox'"),
        (LINES, "1. red\n2. fox", "numbered_list", "numbered list instead of the asked-for layout"),
        (LINES, "fox\nred\ncup", "reordered_items", "items not in the given order"),
        (LINES, "red,fox,cup", "wrong_content", "does not match the reference 'red\\nfox\\ncup'"),
        (LINES, "red fox cup", "wrong_content", "does not match the reference 'red\\nfox\\ncup'"),
        (REPEAT, "tiger tiger", "wrong_count", "2 items instead of 3"),
        (REPEAT, "tigertigertiger", "missing_space", "missing space"),
        (YES, "Yes", "wrong_case", "wrong letter case: expected 'yes'"),
        (YES, "no", "wrong_content", "does not match the reference 'yes'"),
        (YES, "yes\nyes\nyes", "missing_eos", "run-on answer: repeats itself instead of ending"),
        (NEXT, "There are 2 words.", "extra_chatter", "correct answer wrapped in extra words"),
        (NEXT, "20", "wrong_content", "does not match the reference '2'"),
        (FIRST, "red, fox, cup", "wrong_count", "3 items instead of 1"),
        (FIRST, "fox", "wrong_content", "does not match the reference 'red'"),
        (LOWER, "TIGER", "wrong_case", "wrong letter case: expected 'tiger'"),
        (LOWER, "tiger\n", "extra_space", "extra whitespace at the start or end"),
    ],
)
def test_hand_written_answers(item, answer, kind, reason):
    assert check(item, answer) == check(item, answer, ended_with_eos=True)
    verdict = check(item, answer)
    assert (verdict.passed, verdict.kind, verdict.reason) == (False, kind, reason)


def test_hand_written_passes_and_eos():
    assert check(SUM, "RESULT: 43").kind == "pass"
    assert check(LINES, "red\nfox\ncup").passed
    assert check(SUM, "RESULT: 43", ended_with_eos=False).kind == "missing_eos"
    assert check(SUM, "RESULT: 43\n").passed is False


def test_unknown_family_and_kind_are_user_errors():
    with pytest.raises(UserInputError, match="unknown task family 'poetry'"):
        check(TaskItem("poetry", "x\n", "y", ()), "y")
    with pytest.raises(UserInputError, match="cannot produce violation 'fenced_json'"):
        FAMILIES["yes_no"].violate(YES, "fenced_json", random.Random(0))
