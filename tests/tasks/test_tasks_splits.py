"""Splits never share content, are balanced over families, and are reproducible."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from rlhflab.errors import UserInputError
from rlhflab.tasks import FAMILIES, build_splits, partition_pools, sample_items, template_corpus, violations
from rlhflab.tasks.pools import NUMBERS, WORDS, carry_free_pairs


def _content(items) -> set[str]:
    return {c for item in items for c in item.content}


def test_word_pool():
    assert len(WORDS) == len(set(WORDS)) >= 5000
    assert all(w.isalpha() and w.islower() and 3 <= len(w) <= 6 for w in WORDS)
    assert NUMBERS == tuple(range(1, 1000))


@pytest.mark.parametrize("seed", [0, 1, 2, 17, 12345])
def test_pools_are_disjoint_and_cover_everything(seed):
    pools = partition_pools(seed)
    words = [set(p.words) for p in pools.values()]
    numbers = [set(p.numbers) for p in pools.values()]
    assert [len(w) for w in words] == [3325, 1108, 1108]  # 169 real + 5372 made-up words, cut 60/20/20
    # strata: two-digit with digits <= 4 (20), other two-digit (70), other digits <= 4 (104), the rest (805)
    assert [len(n) for n in numbers] == [599, 200, 200]
    assert set.union(*words) == set(WORDS) and set.union(*numbers) == set(NUMBERS)
    for i in range(3):
        for j in range(i + 1, 3):
            assert not words[i] & words[j] and not numbers[i] & numbers[j]


@pytest.mark.parametrize("seed", [0, 1, 2, 17])
def test_test_content_never_seen_in_train_or_validation(seed):
    splits = build_splits(seed)
    assert {k: len(v) for k, v in splits.items()} == {"train": 400, "validation": 300, "test": 300}
    test = _content(splits["test"])
    assert test and not test & _content(splits["train"])
    assert not test & _content(splits["validation"])
    assert not _content(splits["validation"]) & _content(splits["train"])
    # SFT demonstrations come from the train pool, so they never show test content either
    assert not test & _content(sample_items("train", 1000, seed=3, split_seed=seed))


def test_content_is_what_the_prompt_shows():
    for item in build_splits(0)["validation"]:
        for c in item.content:
            assert re.search(rf"(?<![A-Za-z0-9]){c}(?![A-Za-z0-9])", item.prompt, re.IGNORECASE), item


def test_families_spread_evenly_and_prompts_distinct():
    splits = build_splits(3)
    for name, items in splits.items():
        counts = Counter(item.family for item in items)
        assert set(counts) == set(FAMILIES)
        assert max(counts.values()) - min(counts.values()) <= 1, (name, counts)
        assert len({item.prompt for item in items}) == len(items)


def test_any_prefix_is_balanced_over_families():
    """An online run validates on the first eval_prompts (100) of the 300: still ~9 per family."""
    validation = build_splits(0)["validation"]
    for k in (11, 50, 100, 299):
        counts = Counter(item.family for item in validation[:k])
        assert max(counts.values()) - min(counts.values(), default=0) <= 1 and len(counts) == min(k, 11), (k, counts)
    assert [item.family for item in validation[:11]] != [item.family for item in validation[11:22]]  # shuffled rounds


@pytest.mark.parametrize("seed", [1, 38, 64, 219])  # 38: 2 carry-free sum pairs in its test pool before the 4 strata
def test_held_out_splits_have_300_distinct_prompts_per_seed(seed):
    """Every family has enough distinct prompts in each held-out pool for ~27 unique draws (sum_result the scarcest)."""
    pools = partition_pools(seed)
    for split in ("validation", "test"):
        items = build_splits(seed)[split]
        assert len(items) >= 300 and len({item.prompt for item in items}) == len(items), (seed, split)
        two_digit = tuple(n for n in pools[split].numbers if 10 <= n <= 99)
        small = [n for n in two_digit if all(d in "01234" for d in str(n))]
        assert len(small) == 4 and len(carry_free_pairs(two_digit)) >= 4 * 3  # the guarantee the strata give


def test_deterministic_per_seed():
    assert build_splits(5) == build_splits(5)
    assert build_splits(5)["test"] != build_splits(6)["test"]
    assert sample_items("train", 50, seed=1) == sample_items("train", 50, seed=1)
    assert sample_items("train", 50, seed=1) != sample_items("train", 50, seed=2)
    assert build_splits(0, train=11, validation=0, test=22)["validation"] == []


def test_sample_items_rejects_unknown_split():
    with pytest.raises(UserInputError, match="unknown split 'dev'"):
        sample_items("dev", 3, seed=0)


def test_template_corpus_has_frames_but_no_content():
    corpus = template_corpus()
    *frames, charset = corpus
    assert "Add  and . Answer as RESULT: <sum>\n" in frames
    assert "RESULT: " in frames
    assert "\n" in charset and " " in charset and "`" in charset
    text = "\n".join(frames)
    assert [w for w in WORDS if re.search(rf"\b{w}\b", text)] == []
    assert not re.search(r"\d", text)
    used = set()
    for item in sample_items("test", 300, seed=0):
        used |= set(item.prompt + item.reference)
        for answer in violations(item, random.Random(0)).values():
            used |= set(answer)
    assert used <= set(charset)
